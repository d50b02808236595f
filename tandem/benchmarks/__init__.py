"""Pure helpers of the benchmark tools: workload generation (`datasets`) and metric math
(`metrics`). No I/O, no server: unit tests import them directly."""
