"""The Triton backend: the model composed from the kernels in `qwen_triton.operators`."""


class TritonModel:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("backend='triton' is not built yet: use backend='reference'")
