"""decodescope: where does decode time go on a multi-GPU LLM server?"""
__version__ = "0.1.0"
