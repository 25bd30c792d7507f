"""Helpers shared by test modules (test modules never import each other)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The repository root."""
