"""A run's settings, each section and group in a module beside the code that reads it (named in
its docstring); `run.RunConfig` composes them and `loading.load_config` reads them from YAML and
`--set`. The floor below every reader: it imports nothing of the package but errors and a URI syntax."""
