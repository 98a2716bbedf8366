"""Training and evaluation of the small embedded looped model (corpus, Stage-I training, scoring)."""
