"""speculative/drafters subpackage; public names are re-exported from hf_kvspec."""
