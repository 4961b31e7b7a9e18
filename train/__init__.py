"""Training drafters for a target: self-distillation data and the EAGLE head recipe."""
