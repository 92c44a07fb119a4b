"""Build hook for memaudit's one optional C extension; all metadata lives in pyproject.toml.

`memaudit.federated.secagg._maskadd` adds AES-256-CTR masks into the secure-aggregation sum
with OpenSSL (libcrypto) in one fused pass. It needs a C compiler and the OpenSSL headers;
where either is missing the build skips it (``optional=True``) and memaudit uses its numpy
masking path, which gives the same sums, more slowly.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "memaudit.federated.secagg._maskadd",
            ["memaudit/federated/secagg/_maskadd.c"],
            libraries=["crypto"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
