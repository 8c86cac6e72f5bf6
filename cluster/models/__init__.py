"""flotilla.cluster.models: model definitions built from flotilla's parallel-ready layers."""
