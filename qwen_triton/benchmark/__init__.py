"""Measuring the engine against its floor and against what people use today."""
