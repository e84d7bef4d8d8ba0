"""Recipes and placement: which node serves which layers, validated against the artifacts."""
