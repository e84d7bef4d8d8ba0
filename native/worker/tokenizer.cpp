#include "tokenizer.h"

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace dgr::worker {

using grpc::Status;
using grpc::StatusCode;

TokenizerService::TokenizerService(const dgr::ShardEngine & engine, Authorize authorize, TokenizerLimits limits)
    : engine_(engine), authorize_(std::move(authorize)), limits_(limits), n_vocab_(engine.describe().n_vocab) {}

Status TokenizerService::tokenize(const dgr::v1::TokenizeRequest & req, dgr::v1::TokenizeReply * reply) const {
    if (req.text().size() > limits_.max_text_bytes) {
        return Status(StatusCode::INVALID_ARGUMENT, "text: " + std::to_string(req.text().size()) +
                                                        " bytes, more than " + std::to_string(limits_.max_text_bytes));
    }
    for (int32_t t : engine_.tokenize(req.text(), req.add_special())) reply->add_tokens(t);
    return Status::OK;
}

Status TokenizerService::detokenize(const dgr::v1::DetokenizeRequest & req, dgr::v1::DetokenizeReply * reply) const {
    if ((size_t) req.tokens_size() > limits_.max_tokens) {
        return Status(StatusCode::INVALID_ARGUMENT, "tokens: " + std::to_string(req.tokens_size()) +
                                                        ", more than " + std::to_string(limits_.max_tokens));
    }
    for (int i = 0; i < req.tokens_size(); ++i) {
        const int32_t t = req.tokens(i);
        if (t < 0 || t >= n_vocab_) {
            return Status(StatusCode::INVALID_ARGUMENT, "tokens[" + std::to_string(i) + "] = " + std::to_string(t) +
                                                            " is outside the vocabulary [0, " +
                                                            std::to_string(n_vocab_) + ")");
        }
    }
    reply->set_text(engine_.detokenize(std::vector<int32_t>(req.tokens().begin(), req.tokens().end())));
    return Status::OK;
}

Status TokenizerService::chat_template(const dgr::v1::ChatTemplateRequest & req,
                                       dgr::v1::ChatTemplateReply * reply) const {
    if (req.messages_size() == 0 || (size_t) req.messages_size() > limits_.max_messages) {
        return Status(StatusCode::INVALID_ARGUMENT, "messages: " + std::to_string(req.messages_size()) +
                                                        ", must be 1 to " + std::to_string(limits_.max_messages));
    }
    std::vector<std::pair<std::string, std::string>> messages;
    size_t content = 0;
    for (int i = 0; i < req.messages_size(); ++i) {
        const auto & m = req.messages(i);
        if (m.role().empty() || m.role().size() > limits_.max_role_bytes || m.role().find('\0') != std::string::npos) {
            return Status(StatusCode::INVALID_ARGUMENT, "messages[" + std::to_string(i) + "].role: must be 1 to " +
                                                            std::to_string(limits_.max_role_bytes) +
                                                            " bytes without NUL");
        }
        content += m.content().size();
        if (content > limits_.max_text_bytes) {
            return Status(StatusCode::INVALID_ARGUMENT,
                          "messages: content of more than " + std::to_string(limits_.max_text_bytes) + " bytes");
        }
        messages.emplace_back(m.role(), m.content());
    }
    try {
        reply->set_prompt(engine_.apply_chat_template(messages, req.add_assistant()));
    } catch (const std::invalid_argument & e) {
        return Status(StatusCode::FAILED_PRECONDITION, e.what());
    }
    return Status::OK;
}

Status TokenizerService::Tokenize(grpc::ServerContext * ctx, const dgr::v1::TokenizeRequest * req,
                                  dgr::v1::TokenizeReply * reply) {
    if (Status st = authorize_(ctx); !st.ok()) return st;
    return tokenize(*req, reply);
}

Status TokenizerService::Detokenize(grpc::ServerContext * ctx, const dgr::v1::DetokenizeRequest * req,
                                    dgr::v1::DetokenizeReply * reply) {
    if (Status st = authorize_(ctx); !st.ok()) return st;
    return detokenize(*req, reply);
}

Status TokenizerService::Vocabulary(grpc::ServerContext * ctx, const dgr::v1::VocabularyRequest *,
                                    dgr::v1::VocabularyReply * reply) {
    if (Status st = authorize_(ctx); !st.ok()) return st;
    reply->set_n_vocab((uint32_t) n_vocab_);
    for (int32_t t = 0; t < n_vocab_; ++t) {
        if (engine_.is_eog(t)) reply->add_eog(t);
    }
    return Status::OK;
}

Status TokenizerService::ApplyChatTemplate(grpc::ServerContext * ctx, const dgr::v1::ChatTemplateRequest * req,
                                           dgr::v1::ChatTemplateReply * reply) {
    if (Status st = authorize_(ctx); !st.ok()) return st;
    return chat_template(*req, reply);
}

}  // namespace dgr::worker
