"""`memaudit sweep`: train, probe and report over a grid of backends, privacy levels and seeds."""
