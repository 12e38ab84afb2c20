"""The device seam: which torch device a command runs on (select), the device profile every tuning number and
capability of the hot path comes from (profile, capabilities), and the lock that serialises CUDA work (gate)."""
