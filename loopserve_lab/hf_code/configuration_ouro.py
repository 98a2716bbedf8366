"""`OuroConfig` for checkpoints written by loopserve, so that `transformers.AutoConfig` reads their config.json.

`make_tiny` copies this file next to config.json, whose `auto_map` names it; transformers imports it on its own
(with `trust_remote_code=True`: "ouro" is not a model type transformers ships), so it imports nothing else.
Only the configuration is shipped: loopserve runs the model itself, and transformers says so when asked for
a model class instead of failing on a missing file.
"""

from transformers import PretrainedConfig


class OuroConfig(PretrainedConfig):
    """Every config.json key becomes an attribute (PretrainedConfig keeps keys it does not know)."""

    model_type = "ouro"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, total_ut_steps: int = 4, early_exit_threshold: float = 1.0,
                 tie_word_embeddings: bool = False, **kwargs) -> None:
        self.total_ut_steps = total_ut_steps
        self.early_exit_threshold = early_exit_threshold
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
