from .model import ReferenceModel
