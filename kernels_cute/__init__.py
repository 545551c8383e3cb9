"""kernels_cute: the production path on SM120/SM121, wrapping b12x's CuTe DSL GEMMs."""
