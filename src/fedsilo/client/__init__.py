"""Client-side primitives: a client's on-device data, the local training loop and evaluation.

This package sits below the methods and the engine and imports neither: a method composes these primitives into
its local update, the engine only calls the method.
"""
