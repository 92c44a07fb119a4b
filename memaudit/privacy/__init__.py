"""Privacy accounting over dp_accounting: DP-SGD events, ε, calibration and the run's ledger."""
