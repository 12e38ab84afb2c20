"""The request's run: the decoder layer, the static-cache decode path and its capture policy, the stages, the engine."""
