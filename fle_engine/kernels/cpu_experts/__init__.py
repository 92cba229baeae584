"""CPU expert kernels (work in progress: see the package modules)."""
