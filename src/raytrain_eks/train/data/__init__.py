"""Training data, from a file or data set to the packed batches a rank trains on: where it comes from
(:mod:`.sources`), one reader per file kind (:mod:`.json_reader` for JSON and JSONL, :mod:`.tabular` for Parquet, CSV,
TSV and Arrow), each row encoded (:mod:`.encoding`) and packed into blocks (:mod:`.packing`) by the Ray Data
pipeline (:mod:`.pipeline`), each rank's share taken by its cursor (:mod:`.cursor`), and the preview of what the model
will learn (:mod:`.preview`)."""
