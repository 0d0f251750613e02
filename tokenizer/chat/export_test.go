package chat

import "context"

// RenderEngine renders with the Jinja engine only, bypassing the fast path.
func RenderEngine(ctx context.Context, t *Template, in Input) (string, error) {
	return t.renderEngine(ctx, in)
}

// RenderFast renders with the fast path only; false when the template has
// none or it declines in.
func RenderFast(t *Template, in Input) (string, bool) {
	if t.fast == nil {
		return "", false
	}
	return t.fast.run(&in)
}
