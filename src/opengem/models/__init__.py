"""Models: plain nn.Modules with no parallelism inside, plus size presets."""
