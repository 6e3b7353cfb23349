/* dlpack_abi.h — our own declarations of the DLPack 1.x ABI, written from the
 * DLPack specification (dlpack.h v1.3): DLTensor, the legacy and versioned
 * managed tensors carried in PyCapsules, and the C exchange API table that a
 * producer type publishes as `__dlpack_c_exchange_api__` (a PyCapsule named
 * "dlpack_exchange_api"). Only the fields ragvit reads are documented here.
 * Decision: keep our own copy (no vendored header) so the ABI we rely on is
 * visible in one place and checked by tests against real producers. */
#ifndef RAGVIT_DLPACK_ABI_H
#define RAGVIT_DLPACK_ABI_H

#include <stdint.h>

#define RAGVIT_DLPACK_MAJOR 1
#define RAGVIT_DLPACK_MINOR 3 /* the version ragvit.Buffer reports at most */
#define RAGVIT_DLPACK_FLAG_READ_ONLY (1ull << 0)

typedef struct {
    uint32_t major;
    uint32_t minor;
} DLPackVersion;

enum { kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLCUDAManaged = 13 };
enum { kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4, kDLBool = 6 };

typedef struct {
    int32_t device_type;
    int32_t device_id;
} DLDevice;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} DLDataType;

/* strides count elements and may be NULL (legacy producers) for compact
 * row-major; data + byte_offset is the first element. */
typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides;
    uint64_t byte_offset;
} DLTensor;

/* Capsule "dltensor" (legacy); renamed "used_dltensor" by the consumer. */
typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

/* Capsule "dltensor_versioned"; renamed "used_dltensor_versioned". */
typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags;
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

typedef int (*DLPackManagedTensorAllocator)(DLTensor *prototype, DLManagedTensorVersioned **out,
                                            void *error_ctx,
                                            void (*set_error)(void *error_ctx, const char *kind,
                                                              const char *message));
typedef int (*DLPackManagedTensorFromPyObjectNoSync)(void *py_object,
                                                     DLManagedTensorVersioned **out);
typedef int (*DLPackManagedTensorToPyObjectNoSync)(DLManagedTensorVersioned *tensor,
                                                   void **out_py_object);
/* Fills a caller-owned DLTensor; shape/strides stay owned by the producer and
 * are valid while the object lives. 0 on success, -1 with a Python error. */
typedef int (*DLPackDLTensorFromPyObjectNoSync)(void *py_object, DLTensor *out);
typedef int (*DLPackCurrentWorkStream)(int32_t device_type, int32_t device_id,
                                       void **out_current_stream);

typedef struct DLPackExchangeAPIHeader {
    DLPackVersion version;
    struct DLPackExchangeAPIHeader *prev_api;
} DLPackExchangeAPIHeader;

typedef struct {
    DLPackExchangeAPIHeader header;
    DLPackManagedTensorAllocator managed_tensor_allocator;
    DLPackManagedTensorFromPyObjectNoSync managed_tensor_from_py_object_no_sync;
    DLPackManagedTensorToPyObjectNoSync managed_tensor_to_py_object_no_sync;
    DLPackDLTensorFromPyObjectNoSync dltensor_from_py_object_no_sync; /* may be NULL */
    DLPackCurrentWorkStream current_work_stream;
} DLPackExchangeAPI;

#endif /* RAGVIT_DLPACK_ABI_H */
