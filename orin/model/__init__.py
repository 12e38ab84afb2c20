"""The model itself, orin-omni's own modules with transformers' parameter names, built from config.json."""
