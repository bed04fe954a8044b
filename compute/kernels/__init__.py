"""INT8 linear kernels (``int8``), the layers that run them (``linear``), and where a node's kernel plan comes from
(``plans``: the store, this machine's cache, the rule; measured off the request path, on the machine-class artefact
pipeline of ``artefacts``)."""
