"""Model presets (Llama family), the Flax Llama, and HF <-> Flax weight mapping."""
