"""Drafter recipes by method name (imported on demand: each pulls its drafter's module)."""
from __future__ import annotations

METHODS = ("eagle3", "dflash", "medusa", "draft-model")


def get_recipe(method: str):
    if method == "medusa":
        from tokenmill.spec.train.medusa_recipe import MedusaRecipe
        return MedusaRecipe()
    if method == "eagle3":
        from tokenmill.spec.train.eagle3_recipe import Eagle3Recipe
        return Eagle3Recipe()
    if method == "dflash":
        from tokenmill.spec.train.dflash_recipe import DFlashRecipe
        return DFlashRecipe()
    if method == "draft-model":
        from tokenmill.spec.train.distill_recipe import DistillRecipe
        return DistillRecipe()
    raise ValueError(f"unknown drafter method {method!r}; choose one of {METHODS}")
