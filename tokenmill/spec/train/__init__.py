"""Drafter training (`tokenmill train-drafter`): self-distillation data (data.py), the
shared loop (trainer.py) and one recipe per method (recipes.py)."""
