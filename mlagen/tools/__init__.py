"""Tools, the top layer: what the CLI and the benchmarks run on the layers below. Emitting
files and C++ launchers (`emit`, `launcher`, `files`), benchmarking and tuning (`bench`, `tune`,
`timing`, `floor`, `grids`, `peers`, `workload`, `eager`, `report`, `stamp`), testing
(`fuzz`, `testing`) and reading SASS (`sass`).
"""
