"""The IR and the state saved with a model: QModel (model.py: load, save, copies), the quantization
table, decisions, metadata, checks of an input model, graph helpers, the dataflow view and opset
conversion."""
