"""Built-in workloads; each file is one flat, readable training job with a `build(**params)`."""
