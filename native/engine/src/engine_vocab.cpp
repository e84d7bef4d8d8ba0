// The model's tokenizer, shared by ShardEngine and Vocabulary (any load, vocab_only included).
#include "engine.h"

namespace dgr::detail {

// the model's tokenizer, shared by ShardEngine and Vocabulary (any load, vocab_only included)
std::vector<int32_t> vocab_tokenize(const llama_model * model, const std::string & text, bool add_special) {
    const llama_vocab * vocab = llama_model_get_vocab(model);
    std::vector<llama_token> out(text.size() + 16);
    int32_t n = llama_tokenize(vocab, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(),
                               add_special, true);
    if (n < 0) {
        out.resize((size_t) -n);
        n = llama_tokenize(vocab, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(), add_special,
                           true);
    }
    if (n < 0) {
        throw ShardError(Status::invalid_argument, "text could not be tokenized");
    }
    out.resize((size_t) n);
    return out;
}

std::string vocab_detokenize(const llama_model * model, const std::vector<int32_t> & tokens) {
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int32_t n_vocab = llama_vocab_n_tokens(vocab);
    for (int32_t t : tokens) {
        if (t < 0 || t >= n_vocab) {
            throw ShardError(Status::invalid_argument, "token id " + std::to_string(t) + " outside the vocabulary");
        }
    }
    std::string out(tokens.size() * 8 + 16, '\0');
    int32_t n = llama_detokenize(vocab, tokens.data(), (int32_t) tokens.size(), out.data(), (int32_t) out.size(),
                                 false, false);
    if (n < 0) {
        out.resize((size_t) -n);
        n = llama_detokenize(vocab, tokens.data(), (int32_t) tokens.size(), out.data(), (int32_t) out.size(), false,
                             false);
    }
    out.resize((size_t) std::max(n, 0));
    return out;
}

std::string vocab_chat(const llama_model * model, const std::vector<std::pair<std::string, std::string>> & messages,
                       bool add_assistant) {
    const char * tmpl = llama_model_chat_template(model, nullptr);
    if (tmpl == nullptr) {
        throw ShardError(Status::invalid_argument, "the model carries no chat template");
    }
    std::vector<llama_chat_message> chat;
    size_t total = 0;
    for (const auto & m : messages) {
        chat.push_back({m.first.c_str(), m.second.c_str()});
        total += m.first.size() + m.second.size();
    }
    std::string out(total * 2 + 256, '\0');
    int32_t n = llama_chat_apply_template(tmpl, chat.data(), chat.size(), add_assistant, out.data(), (int32_t) out.size());
    if (n > (int32_t) out.size()) {
        out.resize((size_t) n);
        n = llama_chat_apply_template(tmpl, chat.data(), chat.size(), add_assistant, out.data(), (int32_t) out.size());
    }
    if (n < 0) {
        throw ShardError(Status::invalid_argument, "the model's chat template is not one llama.cpp can apply");
    }
    out.resize((size_t) n);
    return out;
}

}  // namespace dgr::detail
