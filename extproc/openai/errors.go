package openai

import (
	"errors"
	"fmt"
)

// Errors returned by [Parse]. They are wrapped with the field concerned, so
// test them with [errors.Is]; [errors.As] with a *[FieldError] gives the field.
var (
	// ErrInvalidJSON: the body is empty, truncated, not JSON, nested
	// deeper than [MaxDepth], not valid UTF-8, or not a JSON object.
	ErrInvalidJSON = errors.New("invalid JSON body")
	// ErrInvalidUTF8: the body is not valid UTF-8 (RFC 8259 requires it).
	// It wraps ErrInvalidJSON, so errors.Is(err, ErrInvalidJSON) holds too.
	ErrInvalidUTF8 = fmt.Errorf("%w: not valid UTF-8", ErrInvalidJSON)
	// ErrMissingModel: a chat or completion request has no "model", or it
	// is null or the empty string.
	ErrMissingModel = errors.New("missing model")
	// ErrInvalidField: a field routing reads has the wrong JSON type or an
	// impossible value (a negative max_tokens, a token id that is not a
	// uint32, more than [MaxItems] messages, ...).
	ErrInvalidField = errors.New("invalid field")
)

// FieldError names the request field that [Parse] rejected. It unwraps to
// [ErrInvalidField] or [ErrMissingModel].
type FieldError struct {
	// Field is the JSON path of the value, such as "messages[2].content".
	Field string
	// Reason says what was wrong, for the client.
	Reason string
	// Err is the sentinel: ErrInvalidField or ErrMissingModel.
	Err error
}

// Error implements the error interface.
func (e *FieldError) Error() string {
	return e.Err.Error() + ": " + e.Field + ": " + e.Reason
}

// Unwrap returns the sentinel, so errors.Is works.
func (e *FieldError) Unwrap() error { return e.Err }

func invalid(field, reason string) error {
	return &FieldError{Field: field, Reason: reason, Err: ErrInvalidField}
}
