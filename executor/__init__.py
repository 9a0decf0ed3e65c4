"""The torch executor that applies a strategy JSON to a training run (torch only here)."""
