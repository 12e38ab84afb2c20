"""The checkpoint on disk: the manifest, the file layout, the quantization targets, reading and converting."""
