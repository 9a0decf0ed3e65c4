"""Cost models: hardware profiles, compute, communication and memory estimates."""
