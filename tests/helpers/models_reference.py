"""Tiny model configurations shared by the model tests."""

# d_model 32 / FFN 64 with min_features 16: every attention and FFN linear is TT, the classifier (32 -> 3)
# and the token-type table (2 rows) stay dense.
TINY = dict(
    vocab_size=97,
    d_model=32,
    num_heads=4,
    d_ff=64,
    num_layers=2,
    max_len=16,
    type_vocab_size=2,
    dropout=0.1,
    padding_idx=0,
    layer_config=dict(rank=4, embedding_rank=4, min_features=16),
)


def tiny_with(**layer_options):
    """TINY with some of its layer_config options changed."""
    return dict(TINY, layer_config=dict(TINY["layer_config"], **layer_options))
