from .model import ReferenceModel

__all__ = ["ReferenceModel"]
