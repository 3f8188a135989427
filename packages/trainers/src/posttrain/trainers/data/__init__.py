"""Datasets, samplers and synthetic data for the trainers."""
