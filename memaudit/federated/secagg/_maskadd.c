/* memaudit.federated.secagg._maskadd: AES-256-CTR masks added into a uint32 sum, fused.
 *
 * add_masks(acc, keys, signs, first_block=0) does acc += sum_k sign_k * AES-256-CTR_k (mod
 * 2^32) in place, where keys holds k 32-byte seeds back to back and signs k bytes (1: add,
 * 0: subtract). The keystream is OpenSSL's AES-256-CTR with an all-zero initial counter
 * block, byte for byte what `cryptography`'s Cipher(AES(seed), CTR(bytes(16))) produces (it
 * runs on OpenSSL too), read as native-endian uint32 words; acc[0] takes the keystream from
 * 16-byte block first_block on, so disjoint slices of one sum can be masked in parallel.
 *
 * Why native: in numpy the keystream has to be written to a buffer and added in a second
 * pass; the add then costs about a quarter of the cipher's time. Here each SUB_WORDS piece
 * of keystream is added while it is still in L1, next to the accumulator's piece, which stays
 * there for all k masks. The GIL is released for the whole pass.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <stdint.h>
#include <string.h>

#define SEED_BYTES 32
#define SUB_WORDS 2048 /* 8 KiB of keystream per cipher call: keystream + accumulator + zero
                          input stay in a 32 KiB L1, and the call costs little next to it */

static const unsigned char ZEROS[SUB_WORDS * 4];

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define MULTIVERSION
#endif

MULTIVERSION static void add_words(uint32_t *restrict acc, const uint32_t *restrict ks,
                                   Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) acc[i] += ks[i];
}

MULTIVERSION static void sub_words(uint32_t *restrict acc, const uint32_t *restrict ks,
                                   Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) acc[i] -= ks[i];
}

static PyObject *add_masks(PyObject *self, PyObject *args) {
    Py_buffer acc, keys, signs;
    unsigned long long first_block = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*y*|K", &acc, &keys, &signs, &first_block)) return NULL;
    PyObject *result = NULL;
    EVP_CIPHER_CTX **ctx = NULL;
    Py_ssize_t k = signs.len;
    if (acc.len % 4 != 0 || ((uintptr_t)acc.buf) % 4 != 0 || !PyBuffer_IsContiguous(&acc, 'C')) {
        PyErr_SetString(PyExc_ValueError, "acc must be a contiguous, aligned uint32 buffer");
        goto done;
    }
    if (keys.len != k * SEED_BYTES) {
        PyErr_Format(PyExc_ValueError, "keys must hold %zd seeds of %d bytes, got %zd bytes",
                     k, SEED_BYTES, keys.len);
        goto done;
    }
    ctx = PyMem_Calloc(k > 0 ? (size_t)k : 1, sizeof(*ctx));
    if (ctx == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    unsigned char iv[16] = {0}; /* the initial counter block: first_block, big-endian */
    for (int b = 0; b < 8; b++) iv[15 - b] = (unsigned char)(first_block >> (8 * b));
    for (Py_ssize_t j = 0; j < k; j++) {
        ctx[j] = EVP_CIPHER_CTX_new();
        if (ctx[j] == NULL ||
            EVP_EncryptInit_ex(ctx[j], EVP_aes_256_ctr(), NULL,
                               (const unsigned char *)keys.buf + j * SEED_BYTES, iv) != 1) {
            PyErr_SetString(PyExc_RuntimeError, "OpenSSL could not set up AES-256-CTR");
            goto done;
        }
    }
    uint32_t *a = (uint32_t *)acc.buf;
    const unsigned char *sg = (const unsigned char *)signs.buf;
    Py_ssize_t n = acc.len / 4;
    int ok = 1;
    Py_BEGIN_ALLOW_THREADS
    uint32_t ks[SUB_WORDS];
    for (Py_ssize_t off = 0; off < n && ok; off += SUB_WORDS) {
        Py_ssize_t w = n - off < SUB_WORDS ? n - off : SUB_WORDS;
        for (Py_ssize_t j = 0; j < k; j++) {
            int outl = 0;
            if (EVP_EncryptUpdate(ctx[j], (unsigned char *)ks, &outl, ZEROS, (int)(4 * w)) != 1 ||
                outl != 4 * w) {
                ok = 0;
                break;
            }
            if (sg[j]) add_words(a + off, ks, w);
            else sub_words(a + off, ks, w);
        }
    }
    OPENSSL_cleanse(ks, sizeof(ks)); /* no mask material left on the stack */
    Py_END_ALLOW_THREADS
    if (!ok) {
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL AES-256-CTR failed while masking");
        goto done;
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    if (ctx != NULL) {
        for (Py_ssize_t j = 0; j < k; j++) EVP_CIPHER_CTX_free(ctx[j]);
        PyMem_Free(ctx);
    }
    PyBuffer_Release(&acc);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&signs);
    return result;
}

static PyMethodDef methods[] = {
    {"add_masks", add_masks, METH_VARARGS,
     "add_masks(acc, keys, signs, first_block=0): acc += sum_k sign_k * AES-256-CTR(keys[32k:"
     "32k+32]) from counter block first_block on, mod 2^32."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_maskadd",
    .m_doc = "Fused AES-256-CTR mask addition (see prg.py).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__maskadd(void) { return PyModule_Create(&module); }
