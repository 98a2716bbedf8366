"""Engine: sequences, the sampler, the reference decoder (the oracle), schedulers and the runner."""
