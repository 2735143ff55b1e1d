"""Math on numbers and tensors: logit bounds and the paper's calibration rule, spectral
norms, the FP8 and NVFP4 formats, the radius of a source bounded by parameter values.

Pure functions, traceable by Dynamo. Imports nothing of the package outside this folder.
"""
