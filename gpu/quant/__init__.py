"""Weight formats (GGUF block types) and weir's quantizers into them."""
