"""`RavenConfig` (Huginn) for checkpoints written by loopserve, so that `transformers.AutoConfig` reads their
config.json.

`make_tiny` copies this file next to config.json, whose `auto_map` names it; transformers imports it on its own
(with `trust_remote_code=True`: "huginn_raven" is not a model type transformers ships), so it imports nothing
else. Only the configuration is shipped: loopserve runs the model itself.
"""

from transformers import PretrainedConfig


class RavenConfig(PretrainedConfig):
    """Every config.json key becomes an attribute; the usual names read Huginn's own keys."""

    model_type = "huginn_raven"
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {"hidden_size": "n_embd", "num_attention_heads": "n_heads", "num_hidden_layers": "n_layers",
                     "max_position_embeddings": "block_size"}

    def __init__(self, tie_embeddings: bool = True, **kwargs) -> None:
        self.tie_embeddings = tie_embeddings
        super().__init__(tie_word_embeddings=tie_embeddings, **kwargs)
