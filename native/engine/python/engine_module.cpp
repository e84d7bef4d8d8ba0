// _dgr_engine: the ShardEngine for Python. Inputs are read from numpy buffers in place (no copy;
// wrong dtype or layout is a TypeError, never a silent conversion); outputs hand the engine's
// buffer to numpy without a copy; the GIL is released while llama.cpp computes.
#include "dgr/random_model.h"
#include "dgr/shard_engine.h"
#include "llama.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

namespace py = pybind11;

namespace {

py::object g_shard_error;

dgr::DType parse_dtype(const std::string & name) {
    if (name == "f32") return dgr::DType::f32;
    if (name == "f16") return dgr::DType::f16;
    if (name == "bf16") return dgr::DType::bf16;
    throw py::value_error("boundary dtype must be f32, f16 or bf16, not '" + name + "'");
}

// numpy dtype a boundary of `dtype` travels as (bf16 has no numpy type: raw uint16)
py::dtype numpy_dtype(dgr::DType dtype) {
    switch (dtype) {
        case dgr::DType::f32: return py::dtype::of<float>();
        case dgr::DType::f16: return py::dtype("float16");
        case dgr::DType::bf16: return py::dtype::of<uint16_t>();
    }
    return py::dtype::of<float>();
}

py::array to_numpy(dgr::ForwardResult && result) {
    auto * holder = new std::vector<uint8_t>(std::move(result.data));
    py::capsule owner(holder, [](void * p) { delete static_cast<std::vector<uint8_t> *>(p); });
    const py::dtype dt = result.is_logits ? py::dtype::of<float>() : numpy_dtype(result.dtype);
    return py::array(dt, {(py::ssize_t) result.n_rows, (py::ssize_t) result.row_width}, holder->data(), owner);
}

class PyEngine {
public:
    explicit PyEngine(const dgr::EngineOptions & options) {
        py::gil_scoped_release release;
        engine_ = dgr::ShardEngine::open(options);
    }

    py::dict describe() const {
        const dgr::Description d = engine_->describe();
        py::dict out;
        out["arch"] = d.arch;
        out["model_desc"] = d.model_desc;
        out["n_layer"] = d.n_layer;
        out["layer_first"] = d.layer_first;
        out["layer_last"] = d.layer_last;
        out["n_vocab"] = d.n_vocab;
        out["n_ctx"] = d.n_ctx;
        out["n_batch"] = d.n_batch;
        out["max_sessions"] = d.max_sessions;
        out["is_head"] = d.is_head;
        out["is_tail"] = d.is_tail;
        out["mtp"] = d.mtp;
        out["hc"] = d.boundary.hc;
        out["n_embd"] = d.boundary.n_embd;
        out["needs_token_ids"] = d.boundary.needs_token_ids;
        out["hash_layers"] = d.hash_layers;
        out["weight_bytes"] = d.weight_bytes;
        out["model_buffer_bytes"] = d.model_buffer_bytes;
        out["kv_bytes"] = d.kv_bytes;
        out["compute_bytes"] = d.compute_bytes;
        out["batch_invariant"] = d.batch_invariant;
        out["cache_sessions"] = d.cache_sessions;
        out["cache_bytes"] = d.cache_bytes;
        out["kv_bytes_per_token"] = d.kv_bytes_per_token;
        return out;
    }

    py::dict cache_stats() const {
        const dgr::CacheStats c = engine_->cache_stats();
        py::dict out;
        out["sessions"] = c.sessions;
        out["tokens"] = c.tokens;
        out["bytes"] = c.bytes;
        out["hits"] = c.hits;
        out["misses"] = c.misses;
        out["reused_tokens"] = c.reused_tokens;
        out["evictions"] = c.evictions;
        return out;
    }

    py::array forward(uint64_t session, uint64_t epoch, int32_t n_past, py::object tokens, py::object boundary,
                      bool logits_all, const std::string & out_dtype, bool truncate, uint64_t prefix_hash, bool mtp,
                      bool reuse, uint64_t lineage) {
        dgr::ForwardRequest req;
        req.reuse = reuse;
        req.lineage = lineage;
        req.mtp = mtp;
        req.session = session;
        req.epoch = epoch;
        req.n_past = n_past;
        req.logits_all = logits_all;
        req.truncate = truncate;
        req.prefix_hash = prefix_hash;
        const dgr::Description d = engine_->describe();
        py::buffer_info tok_info, bnd_info;
        if (!tokens.is_none()) {
            auto arr = py::cast<py::array>(tokens);
            if (!arr.dtype().equal(py::dtype::of<int32_t>()) || arr.ndim() != 1 ||
                !(arr.flags() & py::array::c_style)) {
                throw py::type_error("tokens must be a C-contiguous 1-D int32 array");
            }
            tok_info = arr.request();
            req.tokens = static_cast<const int32_t *>(tok_info.ptr);
            req.n_tokens = (int32_t) tok_info.shape[0];
        }
        if (!boundary.is_none()) {
            auto arr = py::cast<py::array>(boundary);
            dgr::DType dtype;
            if (arr.dtype().equal(py::dtype::of<float>())) {
                dtype = dgr::DType::f32;
            } else if (arr.dtype().equal(py::dtype("float16"))) {
                dtype = dgr::DType::f16;
            } else if (arr.dtype().equal(py::dtype::of<uint16_t>())) {
                dtype = dgr::DType::bf16;
            } else {
                throw py::type_error("boundary dtype must be float32, float16 or uint16 (bf16 bits), not " +
                                     std::string(py::str(arr.dtype())));
            }
            if (arr.ndim() != 2 || arr.shape(1) != (py::ssize_t) d.boundary.hc * d.boundary.n_embd ||
                !(arr.flags() & py::array::c_style)) {
                throw py::value_error("boundary must be a C-contiguous [n_tokens, " +
                                      std::to_string(d.boundary.hc * d.boundary.n_embd) + "] array");
            }
            if (req.tokens != nullptr && arr.shape(0) != req.n_tokens) {
                throw py::value_error("tokens and boundary disagree on n_tokens");
            }
            bnd_info = arr.request();
            req.boundary = bnd_info.ptr;
            req.boundary_dtype = dtype;
            req.n_tokens = (int32_t) arr.shape(0);
        }
        const dgr::DType out = parse_dtype(out_dtype);
        dgr::ForwardResult result;
        {
            py::gil_scoped_release release;
            result = engine_->forward(req, out);
        }
        return to_numpy(std::move(result));
    }

    std::vector<int32_t> draft_mtp(uint64_t session, int32_t n_keep, int32_t token, int32_t max_draft) {
        py::gil_scoped_release release;
        return engine_->draft_mtp(session, n_keep, token, max_draft);
    }

    void release_session(uint64_t session) { engine_->release(session); }
    std::vector<int32_t> tokenize(const std::string & text, bool add_special) const {
        return engine_->tokenize(text, add_special);
    }
    py::bytes detokenize(const std::vector<int32_t> & tokens) const { return py::bytes(engine_->detokenize(tokens)); }
    bool is_eog(int32_t token) const { return engine_->is_eog(token); }
    std::string apply_chat_template(const std::vector<std::pair<std::string, std::string>> & messages,
                                    bool add_assistant) const {
        return engine_->apply_chat_template(messages, add_assistant);
    }
    std::vector<uint64_t> sessions() const { return engine_->sessions(); }

private:
    std::unique_ptr<dgr::ShardEngine> engine_;
};

}  // namespace

PYBIND11_MODULE(_dgr_engine, m) {
    m.doc() = "DGR ShardEngine over patched llama.cpp";
    g_shard_error = py::exception<dgr::ShardError>(m, "ShardError", PyExc_RuntimeError);
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const dgr::ShardError & e) {
            py::object err = g_shard_error(e.what());
            err.attr("status") = dgr::status_name(e.status());
            PyErr_SetObject(g_shard_error.ptr(), err.ptr());
        }
    });

    py::class_<PyEngine>(m, "Engine")
        .def(py::init([](const std::string & model_path, int32_t layer_first, int32_t layer_last, int32_t n_threads,
                         int32_t n_ctx, int32_t n_batch, int32_t max_sessions, int32_t poll, bool load_mtp,
                         bool estimate_only, int32_t gpu_layers, bool batch_invariant, int32_t cache_sessions,
                         uint64_t cache_bytes) {
                 dgr::EngineOptions o;
                 o.model_path = model_path;
                 o.layer_first = layer_first;
                 o.layer_last = layer_last;
                 o.n_threads = n_threads;
                 o.n_ctx = n_ctx;
                 o.n_batch = n_batch;
                 o.max_sessions = max_sessions;
                 o.poll = poll;
                 o.load_mtp = load_mtp;
                 o.gpu_layers = gpu_layers;
                 o.estimate_only = estimate_only;
                 o.batch_invariant = batch_invariant;
                 o.cache_sessions = cache_sessions;
                 o.cache_bytes = cache_bytes;
                 return std::make_unique<PyEngine>(o);
             }),
             py::arg("model_path"), py::arg("layer_first") = 0, py::arg("layer_last") = -1, py::arg("n_threads") = 2,
             py::arg("n_ctx") = 2048, py::arg("n_batch") = 512, py::arg("max_sessions") = 4,
             py::arg("poll") = 50, py::arg("load_mtp") = false, py::arg("estimate_only") = false,
             py::arg("gpu_layers") = 0, py::arg("batch_invariant") = true, py::arg("cache_sessions") = 0,
             py::arg("cache_bytes") = 0)
        .def("describe", &PyEngine::describe)
        .def("forward", &PyEngine::forward, py::arg("session"), py::arg("epoch"), py::arg("n_past"),
             py::arg("tokens") = py::none(), py::arg("boundary") = py::none(), py::arg("logits_all") = false,
             py::arg("out_dtype") = "f32", py::arg("truncate") = false,
             py::arg("prefix_hash") = 0, py::arg("mtp") = false, py::arg("reuse") = false, py::arg("lineage") = 0)
        .def("cache_stats", &PyEngine::cache_stats)
        .def("draft_mtp", &PyEngine::draft_mtp, py::arg("session"), py::arg("n_keep"), py::arg("token"),
             py::arg("max_draft"))
        .def("release", &PyEngine::release_session, py::arg("session"))
        .def("sessions", &PyEngine::sessions)
        .def("tokenize", &PyEngine::tokenize, py::arg("text"), py::arg("add_special") = true)
        .def("detokenize", &PyEngine::detokenize, py::arg("tokens"))
        .def("is_eog", &PyEngine::is_eog, py::arg("token"))
        .def("apply_chat_template", &PyEngine::apply_chat_template, py::arg("messages"),
             py::arg("add_assistant") = true);
    py::class_<dgr::Vocabulary>(m, "Vocabulary")
        .def(py::init([](const std::string & model_path) {
                 py::gil_scoped_release release;
                 return std::make_unique<dgr::Vocabulary>(model_path);
             }),
             py::arg("model_path"))
        .def_property_readonly("n_vocab", &dgr::Vocabulary::n_vocab)
        .def("tokenize", &dgr::Vocabulary::tokenize, py::arg("text"), py::arg("add_special") = true)
        .def("detokenize",
             [](const dgr::Vocabulary & v, const std::vector<int32_t> & tokens) { return py::bytes(v.detokenize(tokens)); },
             py::arg("tokens"))
        .def("is_eog", &dgr::Vocabulary::is_eog, py::arg("token"))
        .def("apply_chat_template", &dgr::Vocabulary::apply_chat_template, py::arg("messages"),
             py::arg("add_assistant") = true);
    m.def("range_supported", &dgr::range_supported);
    m.def("build_info", [] {
        const dgr::BuildInfo & b = dgr::build_info();
        py::dict d;
        d["llama_commit"] = b.llama_commit;
        d["patch_stack_sha256"] = b.patch_stack_sha256;
        d["lane"] = b.lane;
        d["schema_version"] = b.schema_version;
        return d;
    });
    m.def("generate_random_model",
          [](const std::string & metadata_path, const std::string & out_path, uint64_t seed, float stdev,
             const std::map<std::string, std::string> & tensor_types) {
              dgr::RandomModelSpec spec{metadata_path, out_path, seed, stdev, tensor_types};
              py::gil_scoped_release release;
              dgr::generate_random_model(spec);
          },
          py::arg("metadata_path"), py::arg("out_path"), py::arg("seed"), py::arg("stdev") = 0.1f,
          py::arg("tensor_types") = std::map<std::string, std::string>{});
}
