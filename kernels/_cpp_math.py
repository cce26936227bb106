"""C++ snippets that more than one of quantkit's C++ kernels inline (GCC/Clang vector extensions).

Each function returns the source of one ``static inline`` function for the kernel's own vector
types, so every kernel keeps its vector width and its names, and the math has one source.
"""

from __future__ import annotations

__all__ = ["cephes_expf"]


def cephes_expf(name: str, vec: str, ivec: str, *, clamp_high: bool = True, attributes: str = "") -> str:
    """``vec name(vec x)``: exp of each lane, Cephes ``expf`` (range reduction by ln 2 in two parts,
    a degree-6 polynomial; relative error ~1e-7). Lanes below -87 give exactly 0 (a masked score's
    -inf too); with ``clamp_high`` lanes above 88 are clamped there (pass False where the caller
    guarantees x <= 0). ``vec`` is a float vector type, ``ivec`` the int32 vector of its width;
    ``attributes`` (e.g. ``__attribute__((optimize("fp-contract=fast")))``) go before the function."""
    high = f"  x = x > 88.0f ? ({vec}){{}} + 88.0f : x;\n" if clamp_high else ""
    return (
        f"{attributes + ' ' if attributes else ''}static inline {vec} {name}({vec} x) {{\n"
        f"  const {ivec} lo = x < -87.0f;\n"
        f"  x = lo ? ({vec}){{}} - 87.0f : x;\n"
        f"{high}"
        f"  const {vec} n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest\n"
        f"  const {vec} r = (x - n * 0.693359375f) + n * 2.12194440e-4f;\n"
        f"  {vec} p = ({vec}){{}} + 1.9875691500e-4f;\n"
        f"  p = p * r + 1.3981999507e-3f;\n"
        f"  p = p * r + 8.3334519073e-3f;\n"
        f"  p = p * r + 4.1665795894e-2f;\n"
        f"  p = p * r + 1.6666665459e-1f;\n"
        f"  p = p * r + 5.0000001201e-1f;\n"
        f"  p = p * r * r + r + 1.0f;\n"
        f"  const {vec} two_n = ({vec})((__builtin_convertvector(n, {ivec}) + 127) << 23);\n"
        f"  return lo ? ({vec}){{}} : p * two_n;\n"
        f"}}\n")
