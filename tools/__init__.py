"""Analyses that are not training: the compositional ITM probe (``python -m tools.probe``)."""
