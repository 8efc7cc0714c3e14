"""The critical path of each decode step across lanes and ranks: pieces, links and the walk (path), its
table and summary, each collective split into arrival skew and transfer (split), the what-if replays
(whatif), the record 04 writes (record) and the path as a Chrome trace (chrome)."""
