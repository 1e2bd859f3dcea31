"""The IR and the state saved with a model: QModel (model.py: load, save, copies), the quantization
table, decisions, metadata, checks of an input model, graph helpers, cached analyses (typed keys),
the dataflow view and opset conversion."""
