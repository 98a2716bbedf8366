"""Paged KV cache: the store and its block allocator (`pool`), the layouts that map (layer, depth) to slots
(`layout`), the per-sequence block tables (`block_table`) and their manager (`manager`), prefix caching (`prefix`),
and decode attention scores read where the keys lie (`scores`)."""
