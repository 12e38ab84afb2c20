"""orin-omni workstation side: calibration, GPTQ and the manifest writer."""
