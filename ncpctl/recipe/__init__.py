"""Recipes: declarative YAML, typed and validated before any heavy work."""

from ncpctl.recipe.load import BUILTIN_STDLIB, Recipe, load_recipe, parse_set

__all__ = ["BUILTIN_STDLIB", "Recipe", "load_recipe", "parse_set"]
