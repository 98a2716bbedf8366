"""Training and evaluation of the small embedded looped model (corpus, Stage-I training, scoring)."""

from pathlib import Path


def embedded_model_path() -> Path:
    """The shipped Shakespeare-trained Ouro-architecture model (HF layout, inside the package)."""
    return Path(__file__).resolve().parents[1] / "assets" / "ouro-shakespeare"
