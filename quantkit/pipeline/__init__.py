"""The quantization pipeline: capture, prepare (annotations to observers, BN folding), calibrate, convert.

Also the graph helpers those steps share: normalising inputs, module scopes, quantizable layers,
and variants of one model that keep chosen layers float. The public entry points are re-exported
by ``quantkit`` itself (``quantkit.quantize``, ``prepare``, ``calibrate``, ``convert``, ``capture``).
"""

__all__: list[str] = []
