"""Training: the trainer loop, optimizers, learning-rate schedules and data sets."""
